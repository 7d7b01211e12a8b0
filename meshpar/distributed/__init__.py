"""Collectives and the mesh: the named DeviceMesh (mesh), labelled collectives and their record
(comm, comm_record), gradient clipping across mesh dims (clip), and _torch, the one module that
names private torch APIs."""
