"""The backend-free core: types, protocols, the engine loop, verification, sampling, the k
controller and text streaming. Imports the standard library, numpy and app.core only.
"""
