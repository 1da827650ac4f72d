"""Side-by-side benchmarks of tq-redis and the reference system (transferqueue 0.1.11)."""
