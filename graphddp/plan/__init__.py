"""Pure planning: buckets from facts and options, the cost model and simulation, the auto plan. No torch.fx, no process group."""
