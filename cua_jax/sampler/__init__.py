"""Rollout sampler: paged KV cache, paged-attention kernels, sampling and the batching Engine.

from cua_jax.sampler import Engine, SamplingParams
engine = Engine(model, max_slots=16, page_size=16, num_pages=1024, max_seq_len=4096)
out = await engine.generate(prompt_ids, pixel_values, image_grid_thw,
                            params=SamplingParams(temperature=1.0, seed=3), session_id=ep)

Modules: `scheduler` (host-side slots, sessions, admission, preemption; no JAX), `steps` (the
jitted prefill / decode programs), `engine` (the async Engine tying them together), `page_table`,
`kv_cache`, `params` (`SamplingParams`), `sampling`, `kernels`. Names are imported lazily, so
`cua_jax.sampler.scheduler`, `page_table` and `params` load without JAX.
"""

from cua_jax import lazy

_EXPORTS = {
    "Engine": "cua_jax.sampler.engine",
    "GenerateOutput": "cua_jax.sampler.scheduler",
    "OutOfPagesError": "cua_jax.sampler.page_table",
    "PageAllocator": "cua_jax.sampler.page_table",
    "PageTable": "cua_jax.sampler.kv_cache",
    "SamplingParams": "cua_jax.sampler.params",
    "SlotSampling": "cua_jax.sampler.sampling",
    "sample_tokens": "cua_jax.sampler.sampling",
}

__getattr__, __dir__, __all__ = lazy.exports(__name__, _EXPORTS)
