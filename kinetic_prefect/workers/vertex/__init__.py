"""The ``kinetic-vertex`` worker type: a kinetic job as a Vertex AI custom job, built on prefect-gcp's Vertex AI worker.

One module each: ``machines`` (the catalog as Vertex machine specs, or a refusal), ``variables`` (the pool's form),
``configuration`` (the job configuration and the ``CustomJob`` request built from it), ``service`` (the JobService
client and the job's logs), ``launcher`` (creating, following and cancelling custom jobs), ``worker`` (the Prefect
worker class on the shared lifecycle).
"""
