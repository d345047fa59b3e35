"""What tests, benchmarks and the demo share: generated sample images, the fake multi-node autoscaling cluster."""
