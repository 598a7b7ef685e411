"""torch.fx: facts from a backward graph, tracing and splicing, the communication rewrite, the verifier, generated-code readers."""
