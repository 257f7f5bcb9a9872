"""The chunk inspector behind the ``equeue`` command: summaries, records and verification.

Everything here reads a store without changing it: no lock is taken, no file is
created, every file is opened read-only, so it runs beside a live writer or on a copy.
"""
