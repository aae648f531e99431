"""Networking on hivemind (never imports transformers or datasets).

- ``dht``: multiaddr validation, identity files, joining the DHT with bounded retries.
- ``records``: signed, schema-validated DHT records (run manifests, peer progress, leader leases).
- ``averaging``: the region all-reduce (``RegionAverager``) and late-joiner state download.
- ``barrier``: waiting for the live peers of a region before a round.
- ``leader``: electing one leader per region through an expiring DHT lease.
- ``world``: world rounds among region leaders (backbone all-reduce, residual records, residuals
  fetched peer to peer).
- ``monitor``: the read-only view of a run that ``worldlm-monitor`` shows, built from the records.
"""
