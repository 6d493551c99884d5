"""RSS of each stage replica after bursts of concurrent streams, with and without the start-up warm-up."""
import sys, time, json, threading, random
from pathlib import Path
import grpc, psutil
sys.path.insert(0, "/work/main")
from cluster.client import make_request
from loadtest.cluster_process import running_server, tree_processes, process_role
from loadtest.serve_voxray import loadtest_config
from loadtest.workload import load_prompts, max_tokens_for
from protos import voxray_pb2_grpc

def rss(root):
    out = {}
    for p in tree_processes(root):
        try:
            role = process_role(p, root)
            if "Stage" in role:
                out[f"{role.split(':')[-1]}[{p.pid}]"] = round(p.memory_info().rss / 1e6, 1)
        except psutil.Error:
            pass
    return out

def play(stub, app, text, i, res):
    req = make_request(text, voice="tara", request_id=f"p{i}-{random.random()}", sampling={"seed": i, "max_tokens": max_tokens_for(text)})
    n = 0
    try:
        for ch in stub.Synthesize(req, metadata=(("application", app),), timeout=120):
            n += 1
        res.append("ok")
    except grpc.RpcError as e:
        res.append(e.code().name)

def main(warm, port):
    cfg = loadtest_config(port, port + 1)
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"warm_up": warm})})
    prompts = load_prompts()
    rng = random.Random(3)
    rows = []
    with running_server(cfg, Path(f"/tmp/probe/scratch-{warm}")) as server:
        stub = voxray_pb2_grpc.SpeechStub(grpc.insecure_channel(server.grpc_target))
        time.sleep(3)
        rows.append(("ready", rss(server.proc.pid), []))
        for c in [1, 2, 4, 8, 12, 12, 4, 12, 12]:
            res, ths = [], []
            for i in range(c):
                t = threading.Thread(target=play, args=(stub, cfg.app_name, prompts[rng.randrange(len(prompts))], i, res))
                t.start(); ths.append(t); time.sleep(0.05)
            for t in ths: t.join()
            time.sleep(2)
            rows.append((c, rss(server.proc.pid), res))
            print(warm, c, rows[-1][1], {r: res.count(r) for r in set(res)}, flush=True)
    return rows

if __name__ == "__main__":
    out = {}
    for warm in (sys.argv[1:] or ["0", "1"]):
        out[warm] = main(warm == "1", 19400 + 10 * int(warm))
    json.dump(out, open("/tmp/probe/rss.json", "w"), indent=1)
