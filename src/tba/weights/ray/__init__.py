"""Weight transports between processes, over Ray: the object store (:mod:`.board`), a gloo
broadcast (:mod:`.broadcast`) and shared slots (:mod:`.ipc`), each the object store's primary
in front of it (:mod:`.fallback`), opened for a run by :mod:`.channel`."""
