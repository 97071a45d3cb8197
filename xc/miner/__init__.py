"""Hard-negative miners. Imports only config, shards, handoff and ann: a miner on another machine
needs nothing but the run directory."""
