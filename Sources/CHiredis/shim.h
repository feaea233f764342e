#ifndef WARDEN_CHIREDIS_SHIM_H
#define WARDEN_CHIREDIS_SHIM_H
#include <hiredis/hiredis.h>
#endif
