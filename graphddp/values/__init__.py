"""The value types every layer shares: the Schedule and its parts, the op vocabulary, collectives as kinds."""
