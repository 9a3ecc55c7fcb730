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
"""
import operator

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
    if st_dtype == "F4" and not block:
        # One packed pair: the header's terms cannot say "0-d", so read bytes and view them.
        sub = fw.from_bytes(reader.read_range(name, begin, end, fw.code), st_dtype, block)
    else:
        sub = fw.finish(reader.read_range(name, begin, end, fw.code,
                                          fw.file_shape(st_dtype, block)), st_dtype)
    if whole:
        return sub  # a block of its own, exactly the result
    return fw.own(sub[adjusted], sub)
