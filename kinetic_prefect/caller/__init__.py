"""The caller side: what runs in the user's flow (the decorator, submitting a call, collecting its outcome).

It reaches the worker side through one door, ``pools.worker_class_for``, for in-process submission.
"""
