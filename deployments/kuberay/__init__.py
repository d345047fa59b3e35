"""KubeRay manifests (RayService, RayJob) and the generator that keeps their Serve config in step with config.yaml."""
