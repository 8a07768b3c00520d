def backend(spec, rotations):
    raise NotImplementedError
