"""Transport: moving the bytes and talking about them. ``protocol`` (message kinds, fields,
validators), ``control`` (token-checked channel) and ``fanout`` (one trainer, N ranks);
``direct`` (write into the engine's exported storage), ``buffers`` (the slot interface) with its
kinds ``shm``, ``cuda_ipc`` and ``broadcast`` made by ``factory``; ``bytesum`` (landed-bytes check)."""
