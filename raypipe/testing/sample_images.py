"""Deterministic sample images of very different sizes, drawn in code (nothing to download)."""

from __future__ import annotations

import numpy as np

# (height, width): thumbnails, photos, a wide banner, a tall receipt, screenshots up to 4K.
DEMO_SIZES = [(32, 32), (48, 64), (96, 128), (224, 224), (240, 320), (120, 960), (1200, 300),
              (480, 640), (720, 1280), (1080, 1920), (1440, 2560), (2160, 3840)]


def sample_image(height: int, width: int, seed: int) -> np.ndarray:
    """Gradients plus seeded noise: cheap to draw, distinct per image, not trivially compressible."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    phase = rng.uniform(0, 2 * np.pi, 3)
    channels = [np.sin(6 * x + 4 * y + p) for p in phase]
    image = np.stack(channels, axis=-1) * 100 + 128 + rng.normal(0, 20, (height, width, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def sample_images(sizes=DEMO_SIZES) -> list[np.ndarray]:
    return [sample_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
