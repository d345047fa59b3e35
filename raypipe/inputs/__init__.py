"""What a request brings, decoded and validated: visual items (`media`; images and their limits) and
sampling parameters."""
