"""The Ray Serve application: OpenAI-compatible ingress, encoder group and decoder deployments (`raypipe serve`)."""
