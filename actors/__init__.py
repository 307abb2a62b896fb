"""The Ray processes: GraphExecutor, BranchStore and OperationWorker actors.
Also the driver-side Session facade that starts them; imports kernel/ only."""

__all__: list[str] = []
