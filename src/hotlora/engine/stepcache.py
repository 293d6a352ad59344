"""Step caching: skip denoiser work on steps whose output is predictable.

Backends, each the field's own library (hotlora only configures them):
- ``dbcache`` (default): cache-dit's DBCache; composes with ``compile_repeated_blocks(fullgraph=True)``
- ``taylorseer``: DBCache plus cache-dit's TaylorSeer calibrator (extrapolates skipped steps)
- ``fbcache``: diffusers' FirstBlockCache hook; its hooks call ``torch.compiler.disable``d code,
  so the denoiser is compiled with ``fullgraph=False``

Never put cache-dit and diffusers' cache hooks on the same model. Thresholds are in the units of
each library (relative residual difference of the first blocks); random-weight test models need
unrealistically high ones to skip anything.
"""

from __future__ import annotations

import logging

from hotlora.settings import StepCache  # the settings; re-exported here for callers of this module
from hotlora.errors import HotloraError

log = logging.getLogger(__name__)
BACKENDS = ("dbcache", "taylorseer", "fbcache")


class StepCacheError(HotloraError):
    """The step cache cannot be applied to this model (a start-up fault)."""


def apply_step_cache(pipeline, experts, config: StepCache, family) -> None:
    """Install the step cache on every denoiser of ``experts`` (name -> module: Wan 2.2 A14B has
    two, each with caches of its own); call before compiling them. cache-dit finds both experts
    itself (its Wan adapter: ``transformer`` and ``transformer_2``, CFG's passes cached apart);
    diffusers' FirstBlockCache is a hook per model. A backend the ``family`` refuses
    (``unserved_step_caches``) is a StepCacheError with its reason."""
    if config.backend not in BACKENDS:
        raise StepCacheError(f"unknown step cache {config.backend!r}; choose one of {', '.join(BACKENDS)}")
    refused = family.unserved_step_caches.get(config.backend)
    if refused:
        raise StepCacheError(f"step cache {config.backend!r} is not served on {family.name}: {refused}")
    try:
        if config.backend == "fbcache":
            from diffusers.hooks import FirstBlockCacheConfig

            for denoiser in experts.values():
                denoiser.enable_cache(FirstBlockCacheConfig(threshold=config.threshold))
        else:
            import cache_dit

            calibrator = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=1) if config.backend == "taylorseer" else None
            cache_dit.enable_cache(
                pipeline,
                cache_config=cache_dit.DBCacheConfig(Fn_compute_blocks=config.compute_blocks, Bn_compute_blocks=0,
                                                     residual_diff_threshold=config.threshold,
                                                     max_warmup_steps=config.warmup_steps),
                calibrator_config=calibrator,
            )
    except ImportError as exc:
        raise StepCacheError(f"step cache {config.backend!r} needs the 'cache' extra: pip install 'hotlora[cache]'") from exc
    except Exception as exc:  # the libraries reject unsupported models in their own ways
        names = ", ".join(sorted({type(d).__name__ for d in experts.values()}))
        raise StepCacheError(f"step cache {config.backend!r} does not support {names}: {exc}") from exc
    log.info("step cache: %s, threshold %.3f", config.backend, config.threshold)
