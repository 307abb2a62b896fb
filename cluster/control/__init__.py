"""The control plane around the lanes (ADR-0068 D5): schedules, the task queue and workers, and the
dispatch outbox with its webhook relay. It depends on the store and the lane registry, never on a
lane's internals; the database is the arbiter of "at most once"."""
