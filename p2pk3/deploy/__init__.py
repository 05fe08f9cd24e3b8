"""Deploying on a rack: `p2pk3 download` (download.py: only the shards of the slots, from the hub or LAN
peers, resumable, SHA-256-verified), the model directory's manifest and the integrity check a node runs
at load (manifest.py), file sharing between nodes (peers.py), which files a slot needs (files.py), and
systemd units (systemd.py). Step by step: docs/deploy.md."""
