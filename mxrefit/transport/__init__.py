"""Transport: moving the bytes and talking about them. ``base`` (the interface: ``SendPath`` on the
trainer, ``LandPath`` on the engine) and ``registry`` (name -> implementation, both sides), with the
transports ``direct`` (write into the engine's exported storage), ``buffered`` (``shm``,
``cuda_ipc``) and ``broadcast``; ``buffers`` (the slot interface) with its kinds made by ``factory``;
``protocol`` (message kinds, fields, validators), ``control`` (token-checked channel) and ``fanout``
(one trainer, N ranks); ``bytesum`` (landed-bytes check)."""
