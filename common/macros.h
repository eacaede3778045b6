/* common/macros.h - container_of, shared by every module that embeds libuv handles. */
#ifndef RF_MACROS_H
#define RF_MACROS_H

#include <stddef.h>

/* The owner of an embedded member (libuv handles embedded in their owner). */
#ifndef container_of
#define container_of(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))
#endif

#endif
