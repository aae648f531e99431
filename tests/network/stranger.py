"""A stranger to an admitting region, speaking the region's protocol from a small script (as a
malicious volunteer would with a modified worldlm-peer): it has no certificate; it publishes a
progress record for the region that claims an absurd round, declares its state for download with
the highest priority, and keeps asking the region's averager for groups with a payload scaled
x1000 and a claimed weight of 1e9.

    python stranger.py RUN_TOML REGION SECONDS MADDR...
"""

import sys
import time

import torch


def main() -> None:
    run_toml, region, seconds, maddrs = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4:]
    from hivemind.utils.crypto import RSAPrivateKey

    from worldlm_p2p.config import NetConfig, PeerConfig, RunManifest
    from worldlm_p2p.net import records
    from worldlm_p2p.net.averaging import RegionAverager
    from worldlm_p2p.net.dht import start_dht
    from worldlm_p2p.peer.joining import build_local
    from worldlm_p2p.rounds import region_payload
    from worldlm_p2p.train import get_flat_params, load_texts, demo_data_dir

    torch.set_num_threads(1)
    m = RunManifest.from_toml(run_toml)
    data = demo_data_dir() / "eu" / "nl_news"
    local = build_local(PeerConfig(region=region, data=str(data)), m, load_texts(data))
    params = get_flat_params(local.model)
    payload = region_payload(local.rule, [t * 1000 for t in params], params)  # a change of 999x the model
    key = RSAPrivateKey()
    validators = records.make_validators(m.run_id, key)
    dht = start_dht(NetConfig(initial_peers=tuple(maddrs)), record_validators=validators)
    averager = RegionAverager(tensors=payload, dht=dht, run_id=m.run_id, region=region, averaging=m.averaging,
                              fingerprint=m.fingerprint())
    averager.set_shared_state(round_index=10 ** 6, tensors=[t * 1000 for t in params])
    print("STRANGER", dht.peer_id, flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rec = records.ProgressRecord(region=region, peer_id=str(dht.peer_id), label="mallory", step=10 ** 6,
                                     tokens=10 ** 9, train_loss=0.1, tokens_per_s=1.0, rounds_completed=10 ** 6,
                                     last_group_size=2, bytes_sent=0, bytes_received=0, round=10 ** 12,
                                     waiting_for_round=10 ** 12, fingerprint=m.fingerprint(), time=time.time())
        records.publish_progress(dht, validators, m.run_id, rec, ttl=15)
        result = averager.run_round(payload, weight=1e9, gather=dict(label="mallory", weight=1e9, tokens=10 ** 9,
                                                                     round=10 ** 12, world=-1))
        print("ROUND", result.ok, result.group_size, (result.error or "")[:120], flush=True)
    averager.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
