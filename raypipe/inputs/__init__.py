"""What a request brings, decoded and validated: visual items (`media`; images, videos and their limits;
`urls` shared by both) and sampling parameters."""
