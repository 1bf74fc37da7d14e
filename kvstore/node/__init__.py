"""The node cache (issue 46): one ``kvstore serve`` per host (:mod:`.daemon`), shared by every engine
of the host (:mod:`.client`), the DRAM slab one memfd the engines map (:mod:`.slab`), control over a
private Unix socket (:mod:`.wire`)."""
