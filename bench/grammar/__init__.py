"""`loraplex bench grammar`: grammar-constrained decoding, llguidance against xgrammar."""
