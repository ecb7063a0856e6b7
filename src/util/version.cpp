#include "meshtrain/version.h"

namespace meshtrain {

const char* version() { return MESHTRAIN_VERSION; }

}  // namespace meshtrain
