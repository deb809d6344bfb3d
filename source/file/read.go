package file

import "errors"

// DefaultMaxFileSize bounds what is read of one manifest file: 64 MiB, about
// 100k Services with their EndpointSlices, far more than one proxy serves. A
// larger file, or a link to an endless one such as /dev/zero, would otherwise
// take the process's memory (regularfile.Read).
const DefaultMaxFileSize = 64 << 20

// ErrEmpty is the error of a manifest file of 0 bytes. Its last content is
// used: "cmd > file" empties the file before cmd writes, and leaves it empty
// when cmd fails or the disk is full, and neither should take its Services
// away. A file that holds only a comment is read as one without objects.
var ErrEmpty = errors.New(`empty (0 bytes): taken for a file being written, its last content is used; to remove its objects, write a comment such as "# none" into it`)
