"""A small, randomly initialised vision encoder in the shape of Qwen2-VL's, for the examples.

Real enough to produce what a multimodal LLM's encoder hands to the language model: per image
token one embedding row (bf16, the LM's hidden size), the image-pad token id, and a 3-D mrope
position (t, h, w). Weights come from a fixed seed, so every process that builds the model gets
the same one and nothing is downloaded.

Pipeline: resize the image to a multiple of 28 pixels per side (like Qwen2-VL's ``smart_resize``,
without PIL: bilinear interpolation in torch), cut it into 14x14 patches (a strided conv), run
two transformer encoder layers over the patches, then merge each 2x2 group of neighbouring
patches into one token with an MLP that projects to the LM's hidden size.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aioembed import Field, Layout

PATCH = 14
MERGE = 2
UNIT = PATCH * MERGE  # pixels per side of one image token
HIDDEN = 896  # hidden size of the language model (Qwen2-0.5B)
IMAGE_PAD_ID = 151655  # Qwen2-VL's <|image_pad|>
MODEL_NAME = "tiny-vit-random-seed0"
MAX_SIDE = 2048  # refuse larger images: the examples keep encodes short
MAX_TOKENS = 4096  # at most 64x64 image tokens (16384 patches in the encoder's full attention)
MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP normalisation, as in Qwen2-VL
STD = (0.26862954, 0.26130258, 0.27577711)

LAYOUT = Layout(
    embeddings=Field((HIDDEN,), torch.bfloat16),
    token_ids=Field((), torch.int32),
    mrope_positions=Field((3,), torch.int64),
)
"""What travels per token; sender and receiver must declare the same fields in the same order."""


@dataclass(frozen=True)
class Image:
    """A raw RGB image: ``height * width * 3`` bytes, row-major (what PNG decoders hand back)."""

    width: int
    height: int
    rgb: bytes

    def __post_init__(self) -> None:
        for name in ("width", "height"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_SIDE:
                raise ValueError(f"{name} must be an integer in [1, {MAX_SIDE}], got {v!r}")
        if len(self.rgb) != self.width * self.height * 3:
            raise ValueError(f"expected width*height*3 = {self.width * self.height * 3} RGB bytes, "
                             f"got {len(self.rgb)}")
        if self.num_tokens > MAX_TOKENS:
            raise ValueError(f"a {self.width}x{self.height} image makes {self.num_tokens} tokens; "
                             f"this example encoder takes at most {MAX_TOKENS}")

    def to_json(self) -> dict[str, Any]:
        """The JSON form the example servers accept: base64 RGB bytes plus the size."""
        return {"width": self.width, "height": self.height, "rgb": base64.b64encode(self.rgb).decode()}

    @classmethod
    def from_json(cls, obj: object) -> Image:
        """Parse ``{"width", "height", "rgb"}``; raises ``ValueError`` with a reason on bad input."""
        if not isinstance(obj, Mapping):
            raise ValueError('image must be an object {"width": int, "height": int, "rgb": base64}')
        data = obj.get("rgb")
        if not isinstance(data, str):
            raise ValueError("image.rgb must be a base64 string of raw RGB bytes")
        try:
            rgb = base64.b64decode(data, validate=True)
        except ValueError as exc:
            raise ValueError(f"image.rgb is not valid base64: {exc}") from None
        return cls(width=obj.get("width"), height=obj.get("height"), rgb=rgb)  # type: ignore[arg-type]

    @property
    def grid(self) -> tuple[int, int]:
        """Image tokens per column and per row after resizing: (rows, columns)."""
        return grid_for(self.width, self.height)

    @property
    def num_tokens(self) -> int:
        """How many embedding rows this image becomes."""
        rows, cols = self.grid
        return rows * cols


def grid_for(width: int, height: int) -> tuple[int, int]:
    """(rows, columns) of image tokens: each side rounded to the nearest multiple of 28, at least 28."""
    return max(1, round(height / UNIT)), max(1, round(width / UNIT))


def test_pattern(width: int, height: int, seed: int = 0) -> Image:
    """A deterministic synthetic image (gradients plus noise), so the examples need no image files."""
    g = torch.Generator().manual_seed(seed)
    ys = torch.linspace(0, 255, height).view(height, 1, 1).expand(height, width, 1)
    xs = torch.linspace(0, 255, width).view(1, width, 1).expand(height, width, 1)
    noise = torch.randint(0, 64, (height, width, 1), generator=g).float()
    img = torch.cat([ys, xs, noise * 4 % 256], dim=2).clamp(0, 255).to(torch.uint8)
    return Image(width=width, height=height, rgb=img.contiguous().numpy().tobytes())


class TinyViT(nn.Module):
    """Patch embedding, a 2-layer transformer over patches, and a 2x2 patch merger to the LM width."""

    def __init__(self, *, hidden: int = HIDDEN, dim: int = 192, heads: int = 3, layers: int = 2) -> None:
        super().__init__()
        self.dim = dim
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=PATCH, stride=PATCH, bias=False)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.merger = nn.Sequential(nn.Linear(MERGE * MERGE * dim, MERGE * MERGE * dim), nn.GELU(),
                                    nn.Linear(MERGE * MERGE * dim, hidden))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels``: (3, H, W) normalised, H and W multiples of 28. Returns (tokens, hidden) float32."""
        x = self.patch_embed(pixels.unsqueeze(0))[0]  # (dim, H/14, W/14)
        _, ph, pw = x.shape
        x = x + _sincos_2d(self.dim, ph, pw).to(x.dtype)
        # Order patches so that each 2x2 group is contiguous (rows of groups, then columns of
        # groups, then the 4 patches of a group), as Qwen2-VL does before its merger.
        x = x.view(self.dim, ph // MERGE, MERGE, pw // MERGE, MERGE).permute(1, 3, 2, 4, 0)
        x = x.reshape(1, ph * pw, self.dim)
        x = self.norm(self.blocks(x))[0]
        return self.merger(x.reshape(-1, MERGE * MERGE * self.dim))  # type: ignore[no-any-return]


def _sincos_2d(dim: int, h: int, w: int) -> torch.Tensor:
    """Fixed 2-D sine/cosine position embedding (dim, h, w): works for any image size."""
    quarter = dim // 4
    freq = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float32) / quarter))
    ys = torch.arange(h, dtype=torch.float32)[:, None] * freq  # (h, quarter)
    xs = torch.arange(w, dtype=torch.float32)[:, None] * freq  # (w, quarter)
    out = torch.zeros(dim, h, w)
    out[:quarter] = ys.sin().T[:, :, None]
    out[quarter:2 * quarter] = ys.cos().T[:, :, None]
    out[2 * quarter:3 * quarter] = xs.sin().T[:, None, :]
    out[3 * quarter:4 * quarter] = xs.cos().T[:, None, :]
    return out


def build_model(seed: int = 0) -> TinyViT:
    """The example encoder with weights drawn from ``seed`` (same seed, same weights, any process)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyViT()
    return model.eval()


def preprocess(image: Image) -> torch.Tensor:
    """RGB bytes -> (3, H, W) float, resized to whole image tokens and normalised."""
    rows, cols = image.grid
    px = torch.frombuffer(bytearray(image.rgb), dtype=torch.uint8).view(image.height, image.width, 3)
    x = px.permute(2, 0, 1).float().div(255.0).unsqueeze(0)
    x = nn.functional.interpolate(x, size=(rows * UNIT, cols * UNIT), mode="bilinear", align_corners=False)[0]
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    return (x - mean) / std


@torch.inference_mode()
def encode(model: TinyViT, image: Image) -> dict[str, torch.Tensor]:
    """The rows one image becomes: embeddings (bf16), token ids and mrope positions, one per token.

    Blocking and CPU-heavy: call it from a worker thread in async code.
    """
    rows, cols = image.grid
    emb = model(preprocess(image)).to(torch.bfloat16)
    n = rows * cols
    idx = torch.arange(n)
    # Qwen2-VL's mrope for one image: t is constant, h and w index the token grid. A language model
    # adds the position where the image starts in its prompt.
    positions = torch.stack([torch.zeros_like(idx), idx // cols, idx % cols], dim=1)
    return {
        "embeddings": emb.contiguous(),
        "token_ids": torch.full((n,), IMAGE_PAD_ID, dtype=torch.int32),
        "mrope_positions": positions.to(torch.int64).contiguous(),
    }


def summarize_embeddings(emb: torch.Tensor) -> dict[str, Any]:
    """Mean and standard deviation of an embedding tensor, as a JSON-friendly dict."""
    f = emb.float()
    return {"shape": list(emb.shape), "dtype": str(emb.dtype).removeprefix("torch."),
            "mean": round(f.mean().item(), 6), "std": round(f.std().item(), 6) if f.numel() > 1 else 0.0,
            "finite": bool(torch.isfinite(f).all().item()), "norm": round(math.sqrt(f.square().sum().item()), 3)}
