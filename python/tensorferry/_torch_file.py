"""torch.save checkpoints (pytorch_model.bin, *.pt) read tensor by tensor without running their
pickles: the engine of the vLLM plugin's .bin/.pt weights.

torch.load (even with weights_only=True) unpickles the whole file and holds every tensor at once;
here the file's pickle is run by tensorferry's own unpickler, which builds only an allowlist of
objects and calls nothing (docs/convert.md), and each tensor is read into its own CPU tensor when
it is asked for: memory follows the tensors the caller keeps, not the file. A zip checkpoint's
CRC-32 is checked before a tensor is given out (the whole storage the tensor reads). Names are
the state dict's, flattened as `tensorferry convert` flattens them ({"model": {"w": t}} gives
"model.w"); values that are not tensors are skipped.
"""
from . import _core


def torch_dtype(name, tensor, path):
    """torch's dtype called `name` (TorchFile's dtype names are torch's own)."""
    import torch
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise _core.UnsupportedError(
            f"{path}: tensor {tensor!r} is torch.{name}, which this torch ({torch.__version__}) "
            f"does not have")
    return dtype


class TorchFile:
    """One torch.save checkpoint at `path` (a file, a pytorch_model.bin.index.json, or a folder
    holding one of those), opened: its pickles run and checked, no tensor read yet.

    entries: [(name, torch dtype name, shape tuple, byte size)] in the order the pickles hold
    them. Errors at open: the refused globals, calls and malformed pickles `tensorferry convert`
    reports (UnsupportedError for a refused global, SafetensorError for a malformed pickle, each
    naming the file and the pickle offset), FileNotFoundError. Use it
    from one thread; close() (or the with block) releases the files."""

    def __init__(self, path):
        self.path = path
        if not hasattr(_core, "TorchFile"):
            raise _core.UnsupportedError(
                f"{path}: this tensorferry was built without libzip "
                f"(TENSORFERRY_WITH_CONVERT=OFF), so it cannot read torch.save files: install "
                f"libzip (Debian: libzip-dev) and reinstall tensorferry, or convert them to "
                f"safetensors first (`tensorferry convert`)")
        self._file = _core.TorchFile(path)
        self.entries = self._file.tensors

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self._file.close()

    def tensors(self, keep=None):
        """(name, torch.Tensor) of the tensors keep(name) selects (None: all), in entries'
        order, each a fresh contiguous CPU tensor read when the generator reaches it. Errors
        while reading: OSError or SafetensorError naming the file and tensor (a CRC mismatch
        among them); Ctrl-C ends a read within 64 MiB, and the CRC check that follows it (which
        re-reads the tensor's whole storage when the read covered only part of it) within
        1 MiB."""
        import torch
        for index, (name, dtype, shape, nbytes) in enumerate(self.entries):
            if keep is not None and not keep(name):
                continue
            tensor = torch.empty(shape, dtype=torch_dtype(dtype, name, self.path))
            if nbytes:
                self._file.read(index, tensor.reshape(-1).view(torch.uint8).numpy())
            yield name, tensor
            del tensor
