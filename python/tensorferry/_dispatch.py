"""load_checkpoint_and_dispatch: a model (on the meta device or not) filled from a checkpoint, each
parameter and buffer allocated once on its target device in its target dtype and the file's bytes
read straight into it (docs/models.md).

The order of the work:
  0. the model's own tie declarations (tie_weights), so that the placement below sees tied
     tensors as one;
  1. the device map: accelerate's own placement (get_balanced_memory, infer_auto_device_map) for
     "auto", "balanced", "balanced_low_0" and "sequential"; a dict as given; one device for all;
  2. the model's tensors grouped by identity (tied parameters are one group, read once), matched
     with the checkpoint's (Loader.describe: dtype and, with tp_rank/tp_size, the rank-local shape);
     missing and unexpected names found before anything is allocated;
  3. every group allocated on its device (empty) and put into the model, so modules are whole;
  4. init_missing for the groups the files lack (before any read: a module's reset_parameters may
     rewrite its loaded parameters too, and the reads come after it);
  5. the reads: tensors whose target dtype is the file's go through Loader.load_into straight into
     the parameters; the others stream batch by batch under the budget, on their target device,
     and are converted there by copy_;
  6. accelerate's dispatch_model when a device map was given (hooks for multi-device maps), as
     accelerate's load_checkpoint_and_dispatch does.
"""
import itertools
import os
import warnings

import torch

from . import _core
from ._loader import Loader
from ._safe_open import is_url
from ._shard import shard_spec, tensor_slice

_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _as_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        got = getattr(torch, dtype.replace("torch.", ""), None)
        if isinstance(got, torch.dtype):
            return got
    raise _core.InvalidArgumentError(f"dtype: {dtype!r} is not a torch dtype")


def _as_device(where):
    if isinstance(where, int):
        # An index of this machine's accelerator (CUDA, XPU, NPU, ...), as accelerate reads one.
        accelerator = getattr(torch, "accelerator", None)
        current = accelerator.current_accelerator() if accelerator is not None else None
        return torch.device(current.type if current is not None else "cuda", where)
    if isinstance(where, str) and where == "disk":
        raise _core.InvalidArgumentError(
            "device_map: 'disk' (offload to offload_folder) is not supported by "
            "tensorferry.torch.load_checkpoint_and_dispatch yet; use accelerate's for disk offload")
    try:
        return torch.device(where)
    except (RuntimeError, TypeError) as e:
        raise _core.InvalidArgumentError(f"device_map: {where!r} is not a device: {e}") from None


def _accelerate():
    try:
        import accelerate
        import accelerate.utils  # noqa: F401
    except ImportError as e:
        raise ImportError("device_map strategies and multi-device dispatch use accelerate's own "
                          "placement: pip install accelerate") from e
    return accelerate


def _resolve_device_map(model, device_map, max_memory, no_split_module_classes, dtype,
                        offload_buffers=False):
    """(dict name-prefix -> device or None for "leave where it is", the map for dispatch_model)."""
    if device_map is None:
        return None, None
    if isinstance(device_map, str) and device_map in _STRATEGIES:
        _accelerate()
        from accelerate.utils import get_balanced_memory, infer_auto_device_map
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory=max_memory,
                                             no_split_module_classes=no_split_module_classes,
                                             dtype=dtype, low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(model, max_memory=max_memory,
                                           no_split_module_classes=no_split_module_classes,
                                           dtype=dtype, offload_buffers=offload_buffers)
    elif not isinstance(device_map, dict):
        device_map = {"": device_map}
    resolved = {prefix: _as_device(where) for prefix, where in device_map.items()}
    return resolved, dict(device_map)


def _device_for(name, resolved, required=True):
    """The device of the longest prefix of `name` (whole dotted components) in the map; None
    when no prefix matches and not `required` (else an error)."""
    best, best_len = None, -1
    for prefix, device in resolved.items():
        if prefix == "" or name == prefix or name.startswith(prefix + "."):
            if len(prefix) > best_len:
                best, best_len = device, len(prefix)
    if best is None and required:
        raise _core.InvalidArgumentError(f"device_map places no prefix of {name!r}")
    return best


def _check_tied_copies(present, described, opened, model, storage_options):
    """Names the model ties (one tensor) that the checkpoint stores apart, as after a fine-tune
    that untied the head: only one of them would be read, the other's values dropped without a
    word (the logits then wrong; accelerate's retie drops them so too, transformers unties such
    names with a warning). Equal copies are the same tensor and load as one; different ones are
    an InvalidArgumentError naming them, before the model is changed: build the model with them
    untied (e.g. tie_word_embeddings=False). The stored copies are compared whole (on the host),
    whatever rank reads them: every rank of a tensor-parallel load decides alike, and copies
    sliced by different shard rules are still equal. Read only where there are some."""
    for g in present:
        stored = [n for n in g.names if n in described]
        if len(stored) < 2:
            continue
        with Loader(opened, select=stored, storage_options=storage_options) as loader:
            copies = loader.load()
        first = copies[stored[0]]
        for other in stored[1:]:
            t = copies[other]
            if t.dtype != first.dtype or t.shape != first.shape or not torch.equal(
                    t.reshape(-1).view(torch.uint8), first.reshape(-1).view(torch.uint8)):
                raise _core.InvalidArgumentError(
                    f"{type(model).__name__} ties {stored[0]} and {other} (one tensor), but the "
                    f"checkpoint stores them with different values: reading one would drop the "
                    f"other; build the model with them untied (e.g. tie_word_embeddings=False)")
        del copies, first


def _checkpoint_file(checkpoint):
    """What a local folder means, as accelerate's load_checkpoint_in_model (and transformers)
    decide: its model.safetensors when there is one, else its one *.index.json; otherwise the
    folder as given (tensorferry's own rule: its index, or all its .safetensors files)."""
    if is_url(os.fspath(checkpoint)) or not os.path.isdir(checkpoint):
        return checkpoint
    single = os.path.join(checkpoint, "model.safetensors")
    if os.path.isfile(single):
        return single
    indexes = [f for f in os.listdir(checkpoint) if f.endswith(".index.json")]
    return os.path.join(checkpoint, indexes[0]) if len(indexes) == 1 else checkpoint


def _local_values(fw, name, tensor, rank, world, spec):
    """Rank `rank`'s slice under `spec` of a materialized model tensor of the full shape (what
    the loader would read of a stored tensor of that name)."""
    st_dtype = fw.st_dtype(tensor.dtype)
    shape = tuple(tensor.shape)
    if st_dtype is None or tuple(fw.file_shape(st_dtype, shape)) != shape:
        raise _core.InvalidArgumentError(
            f"{name}: missing from the checkpoint, and its {tensor.dtype} values cannot be cut "
            f"to rank {rank}'s slice (init_missing= can fill the rank-local tensor)")
    piece = tensor_slice(name, st_dtype, shape, rank, world, spec)
    if piece.dim is None:
        return tensor
    return torch.cat([tensor.narrow(piece.dim, start, length) for start, length in piece.blocks],
                     piece.dim)


def _owner(model, name):
    module_name, _, leaf = name.rpartition(".")
    return (model.get_submodule(module_name) if module_name else model), leaf


class _Group:
    """Model tensors that are one object (tied parameters), and where they come from."""

    def __init__(self, names, tensor, is_param):
        self.names, self.tensor, self.is_param = names, tensor, is_param
        self.source = None        # the checkpoint name read into it
        self.target = None        # the allocated tensor
        self.file_dtype = None
        self.in_place = False     # read into the model's own tensor (kept as it is)


def _model_groups(model):
    persistent = set(model.state_dict(keep_vars=True).keys())
    groups, by_id = [], {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in by_id:
            by_id[id(p)].names.append(name)
        else:
            by_id[id(p)] = g = _Group([name], p, True)
            groups.append(g)
    transient = []  # non-persistent buffers: not in state dicts, so not in files
    for name, b in model.named_buffers(remove_duplicate=False):
        if name not in persistent:
            transient.append((name, b))
            continue
        if id(b) in by_id:
            by_id[id(b)].names.append(name)
        else:
            by_id[id(b)] = g = _Group([name], b, False)
            groups.append(g)
    return groups, transient


def _local_shape(fw, name, torch_dtype, shape, rank, world, spec):
    """The torch shape rank `rank` of `world` holds of a model tensor `name` of full torch
    shape `shape` under `spec` (tensor_slice, the loader's rules)."""
    st_dtype = fw.st_dtype(torch_dtype)
    if st_dtype is None:  # no safetensors type: sliced as bytes of its size (same shape)
        st_dtype = {1: "U8", 2: "U16", 4: "U32", 8: "U64"}.get(torch_dtype.itemsize, "U8")
    piece = tensor_slice(name, st_dtype, fw.file_shape(st_dtype, shape), rank, world, spec)
    return tuple(fw.shape(st_dtype, piece.shape, name))


# Stored tensors whose split dimension runs over attention heads, under the names the builtin
# shard rules split (Llama-family q/k/v/o_proj, GPT-2's attention, BLOOM / GPT-NeoX / Falcon
# query_key_value and their attention output): (name suffix, dimension, which heads: "q" the
# attention heads, "kv" the key/value heads, "qkv" the fused projection's interleaved groups).
_HEAD_SPLITS = (("q_proj.weight", 0, "q"), ("q_proj.bias", 0, "q"),
                ("k_proj.weight", 0, "kv"), ("k_proj.bias", 0, "kv"),
                ("v_proj.weight", 0, "kv"), ("v_proj.bias", 0, "kv"),
                ("o_proj.weight", 1, "q"),
                ("attn.c_attn.weight", 1, "q"), ("attn.c_attn.bias", 0, "q"),
                ("attn.c_proj.weight", 0, "q"),
                ("query_key_value.weight", 0, "qkv"), ("query_key_value.bias", 0, "qkv"),
                ("attention.dense.weight", 1, "q"), ("self_attention.dense.weight", 1, "q"))


def _check_head_splits(model, names, world, spec):
    """Raises InvalidArgumentError when `spec` would cut an attention head of `model` (its config's
    num_attention_heads / num_key_value_heads) between ranks: a contiguous split of a projection
    gives each rank whole heads only when `world` divides their count, and the rules cannot
    replicate a head over several ranks (as vLLM does with key/value heads when tp_size exceeds
    their count). Models without such a config are not checked."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    if callable(text):
        config = text()
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads <= 0 or world <= 1:
        return
    kv_heads = getattr(config, "num_key_value_heads", None)
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        kv_heads = getattr(config, "num_kv_heads", None)  # Falcon's name
    kv_heads = kv_heads if isinstance(kv_heads, int) and kv_heads > 0 else heads
    # A fused query_key_value interleaves q, k and v per head (BLOOM, GPT-NeoX, Falcon-RW), or
    # per key/value group (Falcon's new_decoder_architecture); Falcon's multi_query layout
    # without it holds all the query heads, then one key and one value head, which no
    # contiguous split gives each rank a share of.
    new_arch = getattr(config, "new_decoder_architecture", False) is True
    multi_query = getattr(config, "multi_query", False) is True and not new_arch
    qkv_groups = kv_heads if new_arch else heads
    for name in sorted(names):
        for suffix, dim, kind in _HEAD_SPLITS:
            if name != suffix and not name.endswith("." + suffix):
                continue
            if spec.rule_for(name).get("split") != dim:
                break
            if kind == "qkv" and multi_query:
                raise _core.InvalidArgumentError(
                    f"tp_size={world}: {name} of {type(model).__name__} (multi_query) holds all "
                    f"its query heads and then one key and one value head, which a split of "
                    f"dimension {dim} into {world} contiguous blocks does not give each rank "
                    f"a share of: use shard_rules that replicate "
                    f"{suffix.rsplit('.', 1)[0]}, or no tensor parallelism")
            count = {"q": heads, "kv": kv_heads, "qkv": qkv_groups}[kind]
            if count % world:
                what = {"q": "attention heads (num_attention_heads)",
                        "kv": "key/value heads (num_key_value_heads)",
                        "qkv": ("key/value groups (num_kv_heads)" if new_arch else
                                "attention heads (num_attention_heads)")}[kind]
                raise _core.InvalidArgumentError(
                    f"tp_size={world}: {name} holds {count} {what} of {type(model).__name__}, "
                    f"which {world} ranks cannot share as whole heads (the shard rules split "
                    f"dimension {dim} into {world} contiguous blocks; they do not replicate "
                    f"heads, as vLLM does with key/value heads when tp_size exceeds their "
                    f"count): use a tp_size that divides {count}, or shard_rules that replicate "
                    f"{suffix.rsplit('.', 1)[0]}")
            break


def _target_dtype(model_dtype, file_dtype, dtype):
    """accelerate's rule (set_module_tensor_to_device): without `dtype` every value takes the
    model tensor's dtype, as torch's load_state_dict does; with it, values stored as integers or
    booleans keep the file's dtype and all others take `dtype`."""
    if dtype is None:
        return model_dtype
    if str(file_dtype).startswith(("torch.uint", "torch.int", "torch.bool")):
        return file_dtype
    return dtype


# The default budget of the converting reads: batch buffers of at most this many bytes (or twice
# the largest tensor converted, when larger).
_CONVERT_BUDGET = 256 << 20


def _KEEP(name, tensor):
    """init_missing for strict=False: the model's values, as they are."""


def _check_init_missing(model, groups, init_missing):
    """Raises InvalidArgumentError when `init_missing` cannot initialise `groups` (a string other
    than 'init_fn' / 'reset_parameters', or a module without that method): called before the
    model is changed, so that a refused call leaves it as it was."""
    if init_missing is None or init_missing is _KEEP or callable(init_missing):
        return
    if init_missing not in ("init_fn", "reset_parameters"):
        raise _core.InvalidArgumentError(
            f"init_missing: {init_missing!r}: a callable(name, tensor), 'init_fn' or "
            "'reset_parameters'")
    for g in groups:
        module, _ = _owner(model, g.names[0])
        if not callable(getattr(module, init_missing, None)):
            raise _core.InvalidArgumentError(
                f"init_missing={init_missing!r}: {g.names[0]!r} is missing from the "
                f"checkpoint and its module ({type(module).__name__}) has no {init_missing}()")


def _init_missing(model, groups, init_missing):
    """Initialises `groups` (checked by _check_init_missing)."""
    if init_missing is None or init_missing is _KEEP:
        return
    with torch.no_grad():
        if callable(init_missing):
            for g in groups:
                init_missing(g.names[0], g.target)
            return
        done = set()
        for g in groups:
            module, _ = _owner(model, g.names[0])
            if id(module) not in done:
                getattr(module, init_missing)()
                done.add(id(module))


def _overlaps(t):
    """Whether elements of `t` share memory (a stride 0 over a dimension of more than one: an
    expand()ed tensor), so that it cannot be written element by element."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


def _first_dtensor(model):
    """The name of the first parameter or buffer of `model` that is a DTensor, or None."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support
        return None
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if isinstance(t, DTensor):
            return name
    return None


def load_checkpoint_and_dispatch(model, checkpoint, device_map=None, *, max_memory=None,
                                 no_split_module_classes=None, dtype=None, offload_folder=None,
                                 strict=True, tp_rank=None, tp_size=None, shard_rules=None,
                                 init_missing=None, budget=None, progress=False,
                                 storage_options=None, offload_buffers=False,
                                 offload_state_dict=None, skip_keys=None,
                                 preload_module_classes=None, force_hooks=False,
                                 full_state_dict=True, broadcast_from_rank0=False):
    """Fills `model` (on the meta device or materialized) from `checkpoint` (a file, a directory
    or index of a sharded checkpoint, or an s3://, gs:// or http(s):// URL) and returns it, like
    accelerate.load_checkpoint_and_dispatch; see docs/models.md for the differences.

    device_map: None (tensors stay on their device, a materialized one filled in place when its
    dtype and shape are kept; meta ones go to the CPU), a device ("cpu",
    "cuda:1", 0, torch.device), a dict of module-name prefixes to devices, or "auto", "balanced",
    "balanced_low_0", "sequential" (computed by accelerate with max_memory and
    no_split_module_classes). dtype: tensors are converted to it, except those stored as
    integers or booleans, which keep the file's dtype; without it, every tensor takes the dtype
    of the model's tensor (accelerate's rule). Tied parameters are read once and
    stay tied. strict: unexpected checkpoint tensors are an error (else a warning); tensors the
    model has and the files lack are an error naming them unless init_missing initialises them (a
    callable(name, tensor) filling the tensor in place, or "init_fn"/"reset_parameters": that
    method of the owning module, called before the reads). tp_rank/tp_size/shard_rules: every
    tensor is allocated at the rank-local shape of its slice (init_missing's too, unless the
    model holds rank-local shapes already) and only this rank's bytes are read.
    budget: bytes of batch buffers held at once by the converting reads (the reads into the model
    need none); by default 256 MiB, or twice the largest tensor converted when that is more. offload_buffers, skip_keys, preload_module_classes, force_hooks: passed to
    accelerate's dispatch_model, as accelerate's function does (a device_map given);
    offload_state_dict: accepted and unused (nothing is offloaded while loading).
    offload_folder: unused, as accelerate's is without "disk" entries in the map
    (disk offload is not supported: a "disk" entry is an error naming it). A local folder means
    its model.safetensors when it has one, else its one *.index.json (accelerate's rule), else
    all its .safetensors files. full_state_dict, broadcast_from_rank0: what accelerate passes to
    torch's set_model_state_dict without a device map. For a model of plain tensors both give
    what they give there, every tensor whole on every rank: full_state_dict only concerns
    DTensors, and with broadcast_from_rank0 each rank reads the files itself rather than
    receiving rank 0's (so every rank needs them). A model holding DTensors (FSDP2) is an error
    naming one: tensorferry loads plain tensors (tp_rank/tp_size for a rank's slices)."""
    # offload_folder is only used for "disk" entries of the map, which are refused (_as_device).
    del full_state_dict, broadcast_from_rank0  # see the docstring
    dtensor = _first_dtensor(model)
    if dtensor is not None:
        raise _core.InvalidArgumentError(
            f"{dtensor}: a DTensor (an FSDP2 or torch tensor-parallel model): tensorferry loads "
            "plain tensors; load before sharding the model, or use tp_rank/tp_size")
    checkpoint = _checkpoint_file(checkpoint)
    dtype = _as_dtype(dtype)
    # The model's own tie declarations (transformers' tie_weights; init_empty_weights unties
    # what a constructor tied), before the device map and before tensors are grouped by
    # identity: accelerate's placement counts a tied tensor once and puts its names on one
    # device only when they are one object (its infer_auto_device_map warns "Please use the
    # `tie_weights` method before"; transformers' from_pretrained maps a model already tied).
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    resolved, dispatch_map = _resolve_device_map(model, device_map, max_memory,
                                                 no_split_module_classes, dtype, offload_buffers)
    tp = tp_rank is not None or tp_size is not None
    if tp and resolved is not None and len(set(resolved.values())) > 1:
        raise _core.InvalidArgumentError(
            "tp_rank/tp_size: one device per rank (device_map maps to "
            f"{sorted(set(map(str, resolved.values())))})")
    loader_kw = dict(tp_rank=tp_rank, tp_size=tp_size, shard_rules=shard_rules,
                     storage_options=storage_options)
    # The checkpoint is opened once for the whole call: every read below derives from this
    # open (Loader(opened, ...)), so a file replaced meanwhile is never read with the shapes
    # checked here (its replacement's bytes under the old header's names).
    with Loader(checkpoint, **loader_kw) as opened:
        described = {o.name: o for o in opened._describe()}
        fw = opened._fw
        # The stored tensors' header shapes: with tensor parallelism, the model may hold the full
        # shape (built from its config) or already the rank-local one (described).
        full_shapes = {o.name: opened._reader.info(o.stored).shape
                       for o in described.values()} if tp else {}
        if tp:
            _check_head_splits(model, [o.stored for o in described.values()], tp_size,
                               shard_spec(shard_rules))

        groups, transient = _model_groups(model)
        model_names = {n for g in groups for n in g.names}
        missing, present = [], []
        for g in groups:
            g.source = next((n for n in g.names if n in described), None)
            (present if g.source is not None else missing).append(g)
        unexpected = [n for n in described if n not in model_names]
        if unexpected:
            text = (f"{type(model).__name__}: {len(unexpected)} checkpoint tensor(s) the model "
                    f"does not have: {', '.join(sorted(unexpected)[:20])}" +
                    (" ..." if len(unexpected) > 20 else ""))
            if strict:
                raise _core.InvalidArgumentError("Unexpected key(s) in state_dict: " + text)
            warnings.warn(text, stacklevel=2)
        if missing and init_missing is None and not strict:
            # As torch's load_state_dict(strict=False) and accelerate: a materialized model's
            # tensors the files lack keep their values (a warning names them); meta ones have
            # none to keep.
            kept = sorted(n for g in missing if g.tensor.device.type != "meta" for n in g.names)
            if kept:
                warnings.warn(f"{type(model).__name__}: {len(kept)} tensor(s) are not in "
                              f"{checkpoint} and keep the model's values: "
                              f"{', '.join(kept[:20])}{' ...' if len(kept) > 20 else ''}",
                              stacklevel=2)
            if len(kept) == sum(len(g.names) for g in missing):
                init_missing = _KEEP
        if missing and init_missing is None:
            names = sorted(n for g in missing for n in g.names
                           if strict or g.tensor.device.type == "meta")
            raise _core.InvalidArgumentError(
                f"Missing key(s) in state_dict: {type(model).__name__}: {len(names)} tensor(s) "
                f"are not in {checkpoint}{'' if strict else ' and are on the meta device'}: "
                f"{', '.join(names[:20])}{' ...' if len(names) > 20 else ''} "
                "(init_missing= initialises them; a materialized model's tensors keep their values "
                "with init_missing=lambda name, tensor: None or strict=False)")
        # Every refusal before the model is changed.
        _check_init_missing(model, missing, init_missing)
        _check_tied_copies(present, described, opened, model, storage_options)
        for name, b in transient:
            if b.device.type == "meta":
                raise _core.InvalidArgumentError(
                    f"{name}: a non-persistent buffer on the meta device (no file holds it): "
                    "build the model with its buffers materialized (accelerate's "
                    "init_empty_weights does)")

        def device_of(g):
            if resolved is not None:
                return _device_for(g.names[0], resolved)
            return torch.device("cpu") if g.tensor.device.type == "meta" else g.tensor.device

        # Allocate, checking shapes (the rank-local ones with tensor parallelism). Host tensors that
        # keep the file's dtype are not allocated: they become views of the file's mapping below
        # (copy-on-write, so they stay writable), as safetensors' and accelerate's are.
        # Shapes are torch's (fw.shape): a header's F4 shape counts 4-bit values, torch's
        # float4_e2m1fn_x2 packed pairs.
        cpu = torch.device("cpu")
        mappable = not tp and not is_url(os.fspath(checkpoint))
        mapped = []
        held_full = held_local = False  # with tensor parallelism: which shapes the model holds
        for g in present:
            o = described[g.source]
            g.file_dtype = fw.dtype(o.dtype, g.source)
            shape = tuple(fw.shape(o.dtype, o.shape, g.source))
            if not tp and tuple(g.tensor.shape) != shape:
                raise _core.InvalidArgumentError(
                    f"size mismatch for {g.source}: the checkpoint has shape {list(shape)}, the "
                    f"model {list(g.tensor.shape)}")
            if tp:
                full = tuple(fw.shape(o.dtype, full_shapes[g.source], g.source))
                if tuple(g.tensor.shape) not in (full, shape):
                    raise _core.InvalidArgumentError(
                        f"size mismatch for {g.source}: the checkpoint has shape {list(full)} "
                        f"(rank {tp_rank}'s slice {list(shape)}), the model {list(g.tensor.shape)}")
                if full != shape:
                    held_full = held_full or tuple(g.tensor.shape) == full
                    held_local = held_local or tuple(g.tensor.shape) == shape
            want = _target_dtype(g.tensor.dtype, g.file_dtype, dtype)
            if g.is_param and g.tensor.requires_grad and not (want.is_floating_point
                                                              or want.is_complex):
                # torch refuses such a parameter; found here, not half way through the model.
                raise _core.InvalidArgumentError(
                    f"{g.source}: the checkpoint stores it as {o.dtype}, so the model's parameter "
                    f"would be {want}, and a {want} parameter cannot require gradients (only "
                    "floating point and complex ones can): give the model a parameter with "
                    "requires_grad=False, or a buffer, for it")
            if (resolved is None and g.tensor.device.type != "meta" and want == g.tensor.dtype
                    and tuple(g.tensor.shape) == shape and not _overlaps(g.tensor)):
                # A materialized model and no device map: read into its own tensors, as torch's
                # load_state_dict copies into them (references held elsewhere stay the model's); a
                # non-contiguous one (a transposed view) through a batch and copy_ (below). One
                # whose elements share memory (an expand()ed buffer) cannot be written: replaced.
                g.target, g.in_place = g.tensor.detach(), True
                continue
            if mappable and want == g.file_dtype and device_of(g) == cpu:
                mapped.append(g)
                continue
            g.target = torch.empty(shape, dtype=want, device=device_of(g))
        # The tensors the files lack, at the model's shape; with tensor parallelism, at the
        # rank-local shape of their slice under the shard rules (as a stored tensor of that name
        # would be read), unless the model already holds the rank-local shapes of the tensors read.
        slice_missing = tp and missing and not (held_local and not held_full)
        spec = shard_spec(shard_rules) if slice_missing else None
        for g in missing:
            # A materialized model's tensor keeps its dtype (accelerate leaves the tensors the files
            # lack as they are); a meta one takes `dtype`, as the tensors read do.
            want = g.tensor.dtype
            if g.tensor.device.type == "meta" and dtype is not None and want.is_floating_point:
                want = dtype
            shape = tuple(g.tensor.shape)
            if slice_missing:
                shape = _local_shape(fw, g.names[0], g.tensor.dtype, shape, tp_rank, tp_size, spec)
            if g.tensor.device.type != "meta" and tuple(g.tensor.shape) == shape:
                # A materialized model's tensor the files lack starts from its own values (as
                # accelerate keeps them), never from uninitialised memory; init_missing may change
                # them.
                if resolved is None and want == g.tensor.dtype:
                    g.target, g.in_place = g.tensor.detach(), True
                else:
                    g.target = g.tensor.detach().to(device=device_of(g), dtype=want, copy=True)
                continue
            if g.tensor.device.type != "meta" and slice_missing:
                # Materialized at the full shape: the rank's slice of its own values.
                values = _local_values(fw, g.names[0], g.tensor.detach(), tp_rank, tp_size, spec)
                g.target = values.to(device=device_of(g), dtype=want, copy=True).contiguous()
                continue
            g.target = torch.empty(shape, dtype=want, device=device_of(g))

        # Into the model: every name of a group gets the same object; a parameter keeps its class
        # (a subclass of torch.nn.Parameter), as accelerate keeps it. Every object is made before
        # the first is put: one that cannot be made leaves the model as it was.
        def value_of(g):
            value = g.target
            if g.is_param:
                cls = type(g.tensor) if isinstance(g.tensor, torch.nn.Parameter) else None
                try:
                    value = cls(g.target, requires_grad=g.tensor.requires_grad) if cls else None
                except TypeError:  # a subclass whose constructor takes other arguments
                    value = None
                if value is None:
                    value = torch.nn.Parameter(g.target, requires_grad=g.tensor.requires_grad)
                # Attributes set on the model's parameter (transformers' _is_hf_initialized, a
                # serving engine's weight_loader, ...) stay on the one that replaces it.
                for key, attr in getattr(g.tensor, "__dict__", {}).items():
                    if key not in value.__dict__:
                        setattr(value, key, attr)
            return value

        def put(g, value):
            for name in g.names:
                module, leaf = _owner(model, name)
                if g.is_param:
                    module._parameters[leaf] = value
                else:
                    module._buffers[leaf] = value
            g.target = value

        made = [(g, value_of(g)) for g in groups if g.target is not None and not g.in_place]
        for g, value in made:
            put(g, value)
        moved = {}  # one buffer registered under several names is moved once, and stays shared
        for name, b in transient:
            module, leaf = _owner(model, name)
            device = _device_for(name, resolved, required=False) if resolved is not None else None
            if device is not None:  # not in state dicts: a map need not place it (as accelerate)
                key = (id(b), device)
                if key not in moved:
                    moved[key] = b.to(device)
                module._buffers[leaf] = moved[key]

        _init_missing(model, missing, init_missing)

        # The reads.
        if mapped:
            # populate=True: every page is read during the call, in parallel (each range asked
            # for at once with MADV_WILLNEED, then faulted in with MADV_POPULATE_READ:
            # mapped_file.cc), so the model is resident when it returns; accelerate's and
            # safetensors' mappings are read at first use, one fault at a time
            # (docs/benchmarks.md, "Models").
            # On a network or FUSE file system the files are read instead (prefer_mmap: the mapping
            # is for local file systems), into memory the tensors own.
            with Loader(opened, engine="auto", prefer_mmap=True, populate=True,
                        select=[g.source for g in mapped],
                        progress=progress, **loader_kw) as loader:
                views = loader.load()
            for g in mapped:
                g.target = views.pop(g.source)
                put(g, value_of(g))
            del views
        mapped_ids = {id(g) for g in mapped}
        reading = [g for g in present if id(g) not in mapped_ids]
        # Read in place (load_into): same dtype, in host or CUDA memory, contiguous. The rest (a
        # dtype change, another accelerator: XPU, NPU, MPS, which load_into cannot write, or a
        # model's non-contiguous tensor filled in place) is streamed and copied.
        in_place = [g for g in reading
                    if g.target.dtype == g.file_dtype and g.target.device.type in ("cpu", "cuda")
                    and g.target.is_contiguous()]
        direct = {g.source: g.target.data for g in in_place}
        in_place_ids = {id(g) for g in in_place}
        converted = [g for g in reading if id(g) not in in_place_ids]
        if direct:
            with Loader(opened, progress=progress, **loader_kw) as loader:
                loader.load_into(direct)
        by_device = {}
        for g in converted:
            by_device.setdefault(g.target.device, []).append(g)
        with torch.no_grad():
            for device, gs in by_device.items():
                targets = {g.source: g.target for g in gs}
                # Bounded by default: the converted tensors are allocated already, so an unbounded
                # batch would hold the file's copy of them all beside them.
                held = budget if budget is not None else max(
                    _CONVERT_BUDGET, 2 * max(described[g.source].bytes for g in gs))
                # Batches on the target's device where tensorferry reads to it (CPU, CUDA: a dtype
                # change there is done by the device), else in host memory, copied over.
                read_on = device if device.type in ("cpu", "cuda") else torch.device("cpu")
                with Loader(opened, device=read_on, budget=held, allow_oversized=True,
                            select=list(targets),
                            progress=progress, **loader_kw) as loader:
                    for batch in loader.iter_batches():
                        for name, t in batch.tensors.items():
                            targets[name].copy_(t)
                            del t  # hold nothing of the batch while the next one is read
                        del batch

        if dispatch_map is not None:
            from accelerate import dispatch_model
            model = dispatch_model(model, device_map=dispatch_map, offload_buffers=offload_buffers,
                                   skip_keys=skip_keys,
                                   preload_module_classes=preload_module_classes,
                                   force_hooks=force_hooks)
        return model
