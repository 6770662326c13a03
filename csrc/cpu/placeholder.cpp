// Keeps the per-ISA object libraries non-empty until the first kernel lands.
#include "isa.h"
namespace cbk { namespace CBK_CPU_NS { int placeholder() { return 0; } } }
