"""The execution plan: which dtype x micro-batch a server or ``vqserve tokenize`` runs, chosen by
measuring the exact candidates on this machine and stored as a portable plan file."""
