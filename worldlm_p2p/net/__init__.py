"""Networking on hivemind (never imports transformers or datasets).

- ``keys``: every DHT key and averager prefix of a run (the only place they are composed).
- ``hivemind_compat``: every use of hivemind's private API, checked against the pinned version.
- ``admission``: region keys, peer certificates, and the check a member makes of the others' records.
- ``dht``: multiaddr validation, identity files, joining the DHT with bounded retries.
- ``reachability``: the dial-back check a peer asks of its bootstrap nodes at start.
- ``priority``: the CPU priority of a peer's background work (round threads, hivemind and p2pd).
- ``wire``: bytes on the wire, measured from the kernel's TCP counters of a peer's processes.
- ``records``: signed, schema-validated DHT records (run manifests, peer progress, leader leases).
- ``schemas``: the wire schemas every DHT node checks before storing, and the validators.
- ``codecs``: the wire codecs of a region round (fp16, int8) as hivemind compression classes.
- ``averaging``: the region all-reduce (``RegionAverager``) and late-joiner state download.
- ``robust_allreduce``: hivemind's all-reduce with the robust rule in every reducer, and the check
  of what the reducers send back.
- ``barrier``: waiting for the live peers of a region before a round.
- ``leader``: electing one leader per region through an expiring DHT lease.
- ``world``: world rounds among region leaders (backbone all-reduce, residual records, residuals
  fetched peer to peer).
- ``reader``: the one reader of a run's records (a client-mode DHT node), for the monitor, the
  swarm CLI's live view and the tests.
- ``monitor``: the read-only view of a run that ``worldlm-monitor`` shows, built from the records.
"""
