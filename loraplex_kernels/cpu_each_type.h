/* Includes the header named by TYPED_HEADER once per storage type (cpu_build.C_TYPES):
   `scalar_t` its C type and SFX(name) the name with that type's suffix (name_f32,
   name_bf16). No include guard: each kernel source includes it for its own header. */
#define scalar_t float
#define SFX(name) name##_f32
#include TYPED_HEADER
#undef SFX
#undef scalar_t

#define scalar_t bf16_t
#define SFX(name) name##_bf16
#include TYPED_HEADER
#undef SFX
#undef scalar_t
