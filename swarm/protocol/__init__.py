"""Sans-IO protocol cores: chunk exchange, piece picking, leases, scheduling, peer scores."""
