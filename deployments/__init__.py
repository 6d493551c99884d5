"""Ray Serve deployments (thin shells around the engines) and the app builder."""
