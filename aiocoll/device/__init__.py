"""Device tensors: the device interface and its implementations, and how collectives move them.

Foundation layer: imports only other foundations (aiocoll._errors, _types, _reduce, _env,
_host, the algorithms) and numpy; torch only in ``_cuda`` (loaded when a CUDA tensor is met);
never client/, server/ or the public surface. The modules:

  - ``_device``: the interface (Device, DeviceTensor, Stream, Event, HostBuffer).
  - ``_cuda``: its CUDA implementation over torch, the only module that calls torch.cuda.
  - ``_device_threads``: its CPU stand-in (threads, host memory), for tests without a GPU.
  - ``_device_buffers``: the message driver's buffers on a device.
  - ``_tensors``: turns numpy arrays and torch tensors (CPU or CUDA) into working arrays.
  - ``_staging``: the pinned host staging pipeline. ``_staged_ops``: collectives and messages
    on device tensors, chunk by chunk through it. ``_ipc``: device to device between the ranks
    of one host (CUDA IPC), for the staged collectives that can.
"""
