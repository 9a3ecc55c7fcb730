"""tensorferry: fast, strict loading of safetensors checkpoints.

Drop-in for the safetensors package (change the import, keep the code):

    from tensorferry import safe_open                 # instead of: from safetensors import safe_open
    from tensorferry import serialize, deserialize    # the raw API (TensorSpec, serialize_file)
    from tensorferry.torch import load_file, save_file
    from tensorferry.numpy import load_file, save_file

and a streaming loader for serving engines:

    with tensorferry.Loader("/models/llama", budget="1GB") as loader:
        for name, tensor in loader.iter_tensors():
            model.load_weight(name, tensor)

Tensors are the caller's: they stay valid after files and loaders are closed and are freed when
the last reference goes. docs/python.md has the details.
"""
import atexit

from ._core import (  # noqa: F401
    BudgetExceededError,
    CudaError,
    CudaNotFoundError,
    InvalidArgumentError,
    SafetensorError,
    ShardSpec,
    UnsupportedError,
    __version__,
    check_mapped_files,
    cuda_available,
    idle_staging_bytes,
    mapping_stats,
    release_idle_staging,
    set_mapping_leases,
    wait_for_caches,
)
from ._frameworks import UnsupportedDTypeError  # noqa: F401
from ._loader import Batch, Loader, LoadStats, layers, parse_size  # noqa: F401
from ._safe_open import safe_open  # noqa: F401
from ._serialize import TensorSpec, deserialize, serialize, serialize_file  # noqa: F401
from ._shard import TensorSlice, rule_slice, shard_spec, tensor_slice  # noqa: F401


def _wait_for_caches_at_exit():
    # Copies into caches that outlive their loaders finish before the interpreter goes (the C++
    # library's own exit handler would run after the interpreter is gone); Ctrl-C gives them up.
    import sys
    try:
        failures = wait_for_caches()
    except KeyboardInterrupt:
        print("tensorferry: copies into the cache given up (interrupted); the next load of "
              "those files downloads them again", file=sys.stderr)
        return
    for failure in failures:
        print(f"tensorferry: warning: {failure} (the next load downloads it again)",
              file=sys.stderr)


atexit.register(_wait_for_caches_at_exit)


def _warn_about_unknown_variables():
    # A misspelt setting (TENSORFERRY_BUGDET) would otherwise be ignored without a word. Logged
    # (logger "tensorferry", level WARNING: on stderr unless logging is configured otherwise),
    # not a Python warning: under -W error that would make the import fail, and a variable of
    # another version must not break this one.
    import logging
    from ._core import unknown_environment_variables
    for unknown in unknown_environment_variables():
        logging.getLogger("tensorferry").warning(
            "%s; docs/runtime_settings.md lists the TENSORFERRY_* variables", unknown)


_warn_about_unknown_variables()


def describe_object_store(url, storage_options=None):
    """How the store of `url` (s3://, gs://, http(s)://; a prefix ends with '/') is reached, as
    a dict: the endpoint, region and addressing with where each came from, where the credentials
    come from, the keys fetched when they are fetched (never a secret), and one request as a load
    makes it, timed ("settings", "credentials_status", "probe_status": {ok, code, category,
    message}). Never raises for what it finds: `tensorferry doctor URL --json`'s object_store.
    `storage_options` as Loader's. Ctrl-C ends it (KeyboardInterrupt)."""
    from . import _core
    return _core.describe_object_store(url, dict(storage_options or {}))

__all__ = [
    "safe_open",
    "TensorSpec",
    "serialize",
    "serialize_file",
    "deserialize",
    "cuda_available",
    "mapping_stats",
    "check_mapped_files",
    "set_mapping_leases",
    "release_idle_staging",
    "idle_staging_bytes",
    "wait_for_caches",
    "describe_object_store",
    "SafetensorError",
    "InvalidArgumentError",
    "UnsupportedError",
    "UnsupportedDTypeError",
    "BudgetExceededError",
    "CudaError",
    "CudaNotFoundError",
    "Loader",
    "LoadStats",
    "Batch",
    "layers",
    "parse_size",
    "ShardSpec",
    "TensorSlice",
    "shard_spec",
    "tensor_slice",
    "rule_slice",
    "__version__",
]
