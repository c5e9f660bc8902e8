"""memspec: memory-aware runtime for adaptive multi-draft speculative decoding.

The repository root is the package: ``procs/`` (decoder, loader, predictor),
``common/`` (shared schemas, config, metrics), ``launch/`` (CLI, supervisor),
``zoo/`` (model acquisition and training) and ``bench/`` install as
``memspec.procs``, ``memspec.common`` and so on.
"""

__version__ = "0.1.0"
