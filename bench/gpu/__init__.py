"""``vqserve bench gpu``: every GPU figure the project reports, from one command.

``run`` is the command (its sections, each guarded and saved as it ends), ``measure`` what
each section measures, ``report`` the table it prints and ``targets`` the GPU node's
targets, judged from the result alone (so a stored run reads the same).
"""
