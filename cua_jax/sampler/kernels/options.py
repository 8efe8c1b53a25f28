"""The GPU paged-attention kernel's tuning knobs, apart from the kernel so that the config's
checks (`cua_jax.config.checks`) read them without loading JAX."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuKernelOptions:
    """Tuning knobs of the GPU kernel (they change speed, not results beyond rounding).

    pages_per_block: pages each loop step loads and scores together (more loads in flight).
    f32_dots: cast K/V to f32 and use f32 dots (True, the default), or feed the dots K/V in their
        own dtype with f32 accumulation (bf16 tensor cores; the softmax stays f32).
    num_warps, num_stages: Triton's launch parameters (None: Pallas' defaults).

    The defaults are the first version's behaviour, not yet tuned on a GPU:
    `tools/bench_paged_decode.py --parts=kernel` times a grid of these on one, side by side.
    """

    pages_per_block: int = 1
    f32_dots: bool = True
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        if self.pages_per_block < 1:
            raise ValueError(f"pages_per_block must be >= 1; got {self.pages_per_block}.")
        for name in ("num_warps", "num_stages"):
            n = getattr(self, name)
            if n is not None and n < 1:
                raise ValueError(f"{name} must be >= 1 or None; got {n}.")

    @classmethod
    def parse(cls, spec: str) -> GpuKernelOptions:
        """From "pages_per_block=4,f32_dots=false,num_warps=8" (empty: the defaults)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kw: dict = {}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            name, eq, value = item.partition("=")
            name, value = name.strip(), value.strip().lower()
            if not eq or name not in fields:
                raise ValueError(
                    f"GPU kernel option {item!r}: expected name=value, names {sorted(fields)}."
                )
            if name == "f32_dots":
                if value not in ("true", "false", "1", "0"):
                    raise ValueError(f"GPU kernel option {item!r}: f32_dots is true or false.")
                kw[name] = value in ("true", "1")
            elif value == "none" and name != "pages_per_block":
                kw[name] = None
            else:
                try:
                    kw[name] = int(value)
                except ValueError:
                    raise ValueError(f"GPU kernel option {item!r}: {name} is an integer.") from None
        return cls(**kw)

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())
