#ifndef WARDEN_CZLIB_SHIM_H
#define WARDEN_CZLIB_SHIM_H
#include <zlib.h>
#endif
