"""What a request brings, decoded and validated: images (and their limits) and sampling parameters."""
