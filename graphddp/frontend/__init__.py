"""What users call: compile(), the torch.compile backend object, explain, the command line."""
