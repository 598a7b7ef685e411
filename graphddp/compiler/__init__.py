"""The torch.compile backend that composes the graph passes for every forward and backward graph, its cache and records."""
