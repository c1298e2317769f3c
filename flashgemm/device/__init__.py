"""Device helpers (CuTe DSL) shared by the arch packages and the layer
kernels: the bounded signal wait, the completion publish, the SwiGLU
arithmetic, the error-word bits and layout views. They sit below both: a
module here imports nothing of ``flashgemm`` outside this package."""
