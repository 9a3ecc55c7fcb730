"""get_slice: framework indexing on a tensor that is still in the file.

The result equals ``full_tensor[index]`` under the framework's own rules, errors included: the
index is first applied to a probe, a tensor of the same shape that holds no memory (a zero-stride
broadcast), so every error is the framework's own. Then:

* Basic indexes (integers, slices with any step, Ellipsis, None) read only the bytes the result
  needs, as one contiguous range: the leading integer indexes pin a block, the first slice after
  them bounds it to the rows it touches. The rest of the index is applied to that block.
* Anything else (integer arrays, lists, booleans, tensors used as indexes) reads the whole tensor
  and indexes it.

The result owns its memory: a view that would keep a larger block alive is copied.

F4 (two 4-bit values per byte; torch's float4_e2m1fn_x2 counts packed pairs) is indexed in the
file's units, as get_shape() gives them: the last dimension counts 4-bit values. A selection of
it must keep whole bytes (a slice with step 1 and even bounds; packed_index); it is then applied to
the packed tensor, whose last dimension is half as long.
"""
import operator

from ._core import InvalidArgumentError
from ._frameworks import prod


def _is_int(item):
    if isinstance(item, bool):
        return False
    if isinstance(item, int):
        return True
    # NumPy integer scalars (not arrays, not bools): their __index__ makes them plain ints.
    kind = getattr(getattr(item, "dtype", None), "kind", None)
    return kind in ("i", "u") and getattr(item, "ndim", None) == 0 and \
        type(item).__module__ == "numpy"


def _is_int_tensor(item):
    """A 0-d integer torch tensor: torch takes it as an int (a 0-d bool tensor is a mask)."""
    dtype = getattr(item, "dtype", None)
    return type(item).__module__ == "torch" and getattr(item, "ndim", None) == 0 and \
        not dtype.is_floating_point and not dtype.is_complex and str(dtype) != "torch.bool"


def _slice_text(item):
    parts = [item.start, item.stop] + ([item.step] if item.step is not None else [])
    return ":".join("" if v is None else str(v) for v in parts)


def packed_index(fw, name, st_dtype, st_shape, index):
    """`index` into an F4 tensor of header shape `st_shape` (4-bit values) as the same selection
    of the packed tensor (two values per element): the last dimension's slice halved. The
    framework's own errors for an index that breaks its rules, in the file's units (an int out of
    range, a zero or negative step, too many indices); InvalidArgumentError (a SafetensorError)
    for one that cannot be packed: an index that is not an int, slice, None or Ellipsis (torch
    cannot gather float4 values), or a selection of the last dimension that splits a byte (an
    int, a step other than 1, an odd start or stop)."""
    items = index if isinstance(index, tuple) else (index,)
    where = f"tensor {name!r} ({st_dtype}, shape {list(st_shape)})"
    normalized = []
    for item in items:
        if item is None or item is Ellipsis or isinstance(item, slice):
            normalized.append(item)
        elif _is_int(item) or _is_int_tensor(item):
            normalized.append(operator.index(item))
        else:
            raise InvalidArgumentError(
                f"{where}: index {item!r} is not an int, slice, None or Ellipsis; "
                f"{st_dtype} packs two 4-bit values per byte and can only be sliced")
    fw.probe(st_shape)[tuple(normalized)]  # the framework's errors, in the file's units
    last = len(st_shape) - 1
    consuming = [k for k, item in enumerate(normalized)
                 if item is not None and item is not Ellipsis]
    ellipsis = next((k for k, item in enumerate(normalized) if item is Ellipsis), None)
    if not consuming or (len(consuming) <= last and
                         (ellipsis is None or consuming[-1] < ellipsis)):
        return tuple(normalized)  # the last dimension is taken whole
    k = consuming[-1]
    item, n = normalized[k], st_shape[-1]
    if isinstance(item, int):
        raise InvalidArgumentError(
            f"{where}: index {item} into dimension {last} selects one 4-bit value, half a byte "
            f"({st_dtype} packs two values per byte): select whole bytes with a slice of step 1 "
            f"and even start and stop, e.g. {item - item % 2}:{item - item % 2 + 2}")
    start, stop, step = item.indices(n)
    if len(range(start, stop, step)) == 0:
        normalized[k] = slice(0, 0)
    elif step == 1 and start % 2 == 0 and stop % 2 == 0:
        normalized[k] = slice(start // 2, stop // 2)
    else:
        raise InvalidArgumentError(
            f"{where}: index {_slice_text(item)} into dimension {last} (values {start} to "
            f"{stop} step {step}) splits a byte ({st_dtype} packs two 4-bit values per byte): "
            f"a slice of the last dimension needs step 1 and even start and stop")
    return tuple(normalized)


PROBE = "probe"  # plan(): let the framework judge this index (it raises, or it is unusual)


def plan(index, shape, negative_steps):
    """For a basic index: (first element, element count, block shape, index into the block,
    whether that index selects the whole block as it is). None for any other index (the caller
    reads the whole tensor and indexes it). PROBE when the index breaks a rule (too many indices,
    an integer out of range, a zero step, a negative step where the framework has none): the
    framework's own indexing then raises its own error."""
    items = index if isinstance(index, tuple) else (index,)
    normalized = []
    for item in items:
        if item is None or item is Ellipsis or isinstance(item, slice):
            normalized.append(item)
        elif _is_int(item):
            normalized.append(operator.index(item))
        else:
            return None
    ellipses = sum(1 for item in normalized if item is Ellipsis)
    if ellipses > 1:
        return None
    consuming = sum(1 for item in normalized if item is not None and item is not Ellipsis)
    if consuming > len(shape):
        return PROBE
    fill = [slice(None)] * (len(shape) - consuming)
    if ellipses:
        at = next(i for i, item in enumerate(normalized) if item is Ellipsis)
        normalized = normalized[:at] + fill + normalized[at + 1:]
    else:
        normalized = normalized + fill

    # Every remaining item is checked here, before anything is read.
    dim = 0
    for item in normalized:
        if item is None:
            continue
        n = shape[dim]
        dim += 1
        if isinstance(item, int):
            if not -n <= item < n:
                return PROBE
        else:
            try:
                step = item.indices(n)[2]
            except (TypeError, ValueError):
                return PROBE
            if step < 0 and not negative_steps:
                return PROBE

    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]

    first = 0
    dim = 0
    adjusted = []
    block = None
    for k, item in enumerate(normalized):
        if item is None:
            adjusted.append(None)
            continue
        n = shape[dim]
        if isinstance(item, int):
            first += (item + n if item < 0 else item) * strides[dim]
            dim += 1
            continue
        start, stop, step = item.indices(n)
        rows = range(start, stop, step)
        if len(rows) == 0:
            return first, 0, [0] + list(shape[dim + 1:]), None, False
        lo, hi = min(rows[0], rows[-1]), max(rows[0], rows[-1])
        first += lo * strides[dim]
        block = [hi - lo + 1] + list(shape[dim + 1:])
        head, tail = rows[0] - lo, rows[-1] - lo
        if step > 0:
            adjusted.append(slice(head, tail + 1, step))
        else:
            adjusted.append(slice(head, tail - 1 if tail >= 1 else None, step))
        adjusted.extend(normalized[k + 1:])
        break
    else:
        block = list(shape[dim:])
    whole = bool(block) and all(
        isinstance(item, slice) and item.indices(n) == (0, n, 1)
        for item, n in zip(adjusted, block)) and len(adjusted) <= len(block)
    if ellipses:
        # With an Ellipsis, NumPy returns a 0-d array where integers alone give a scalar; the
        # expanded index has none left, so one goes back at the end (a no-op otherwise).
        adjusted.append(Ellipsis)
    return first, prod(block), block, tuple(adjusted), whole


def get_slice(reader, fw, name, index):
    """reader: _core.Reader; fw: a _frameworks adapter. Returns full[index] for tensor `name`."""
    info = reader.info(name)
    st_dtype, st_shape, nbytes = info.dtype, info.shape, info.bytes
    fw.dtype(st_dtype, name)
    shape = fw.shape(st_dtype, st_shape, name)
    if st_dtype == "F4":
        index = packed_index(fw, name, st_dtype, st_shape, index)
    p = plan(index, shape, fw.negative_steps)
    if p is PROBE:
        fw.probe(shape)[index]  # raises exactly what full[index] would
        p = None  # it did not: let the real tensor decide
    if p is None:
        full = fw.finish(reader.get_tensor(name, fw.code), st_dtype)
        return fw.own(full[index], full)
    first, count, block, adjusted, whole = p
    if count == 0:
        return fw.empty(fw.probe(shape)[index].shape, st_dtype)
    itemsize = nbytes // prod(shape)
    begin, end = first * itemsize, (first + count) * itemsize
    # An F4 block keeps its last dimension (packed_index refuses an int there).
    sub = fw.finish(reader.read_range(name, begin, end, fw.code,
                                      fw.file_shape(st_dtype, block)), st_dtype)
    if whole:
        return sub  # a block of its own, exactly the result
    return fw.own(sub[adjusted], sub)
