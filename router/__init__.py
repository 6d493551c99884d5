"""Router: admission, dispatch policy, ingress servicers (gRPC, HTTP) and audio framing."""
