# Read by llama.cpp's own project() while llama-cpp-python builds it (tests/llama_cpp_build.py passes it as
# CMAKE_PROJECT_llama.cpp_INCLUDE): the tests need only the libraries the Python server loads, built quickly.
#
# llama.cpp's `common` library (and the HTTP library it links) is for llama.cpp's own programs: llama-cpp-python
# forces it on, but its server loads only libllama and ggml through ctypes. A normal variable shadows the forced
# cache entry in llama.cpp's directory, and its option() then keeps it (policy CMP0077).
set(LLAMA_BUILD_COMMON OFF)
# C++ at -O1: src/llama-model.cpp alone compiled in 145 s at -O3 and 27 s at -O1 (a loaded 2-core machine). ggml's
# C kernels keep -O3; how fast a 135M model answers is not what the tests look at.
set(CMAKE_CXX_FLAGS_RELEASE "-O1 -DNDEBUG")
